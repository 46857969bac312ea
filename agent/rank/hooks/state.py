"""What the hooks' modules share that changes after import: the installer of
`install_distributed`, once it ran (DDP names its groups alike)."""

from __future__ import annotations

from typing import Any

installer: Any = None
"""The `installer._Installer` of `install_distributed`, once it ran."""
