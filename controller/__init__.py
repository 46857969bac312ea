"""Decisions and actions: launching and supervising jobs, recovery policy, incidents, the CLI.

The controller acts on verdicts the analysis returns; it never diagnoses by itself. Nothing
imports it.
"""
