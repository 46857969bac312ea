"""Diagnosis: pure functions from trace snapshots to verdicts that say who is at fault and why.

Nothing here acts, sleeps or reads the clock: the caller passes the time in. Nothing here imports
torch, the agent or the controller.
"""
