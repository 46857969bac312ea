"""`python -m tracehound.agent.node`: the node agent."""

from tracehound.agent.node.daemon import main

raise SystemExit(main())
