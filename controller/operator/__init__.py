"""The Kubernetes operator: kopf handlers over `TrainingJob` resources (`handlers`) and the
resource's schema and spec (`trainingjob`)."""
