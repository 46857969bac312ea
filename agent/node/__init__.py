"""The node agent: the daemon beside a node's ranks (`python -m tracehound.agent.node`).

`daemon` takes the ranks' records from its unix socket and ships them to the store through its
durable `spool`; `procwatch` samples each local rank's process from outside (`/proc`, py-spy
stacks); `telemetry` exports the agent's own OpenTelemetry metrics and spans. It polls the
node's health sources (`agent.sources`). Nothing here runs inside a training process.
"""
