"""Supervising one job: the supervisor loop (`supervisor`), the job's state (`jobstate`), the
durable journal of what it stored and decided (`journal`) and where a restart's time went
(`restarts`). It acts through an orchestrator port (`controller.orchestrators`), under a
recovery policy (`controller.policy`), and announces incidents through `controller.alerts`.
"""
