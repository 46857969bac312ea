"""The incident dashboard (to come): reads incidents, actions and traces through
`tracehound.tracing.store` and explanations through `tracehound.analysis`. Nothing here yet."""

__all__: list[str] = []
