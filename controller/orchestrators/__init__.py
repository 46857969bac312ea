"""Where a job's ranks run: the orchestrator port (`port`: every method the supervisor calls)
and its adapters, local processes (`local`) and Kubernetes pods (`kubernetes`, with the objects
it creates in `kubeobjects`)."""
