"""The recovery policy: per verdict kind when to act, isolate or watch, and the limits
(`recovery`), read from and checked against its YAML file (`file`, `policy.schema.json`)."""
