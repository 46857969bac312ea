"""Distinct names for the identifiers that travel through every record."""

from typing import NewType

JobId = NewType("JobId", str)
"""A training job, as named by the user (`tracehound run --job-id`)."""

NodeId = NewType("NodeId", str)
"""A machine (or, on one machine, a group of local ranks) that runs part of a job."""

Rank = NewType("Rank", int)
"""A global rank in the job's default process group."""

GroupId = NewType("GroupId", str)
"""A process group as torch names it (`ProcessGroup.group_name`); "0" is the default group."""
