"""Alerts: incidents announced to Alertmanager, Slack, PagerDuty and signed webhooks, delivered
at least once through a durable outbox."""
