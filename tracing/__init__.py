"""The trace model, its ClickHouse schema and the stores that hold it.

Everything else in Tracehound depends on this package and it depends on none of them. It must
never import torch: the records here are shared by the training-side recorder, the node agent,
the analysis and the controller.
"""
