"""Fully asynchronous rollouts (``--fully-async``): the background worker (``producer.py``), the
bounded buffer between it and the trainer (``buffer.py``) and the source the manager takes each
rollout from (``source.py``)."""
