"""DAPO rollout control: group filters and over-long shaping (``filters.py``), dynamic sampling in
rounds (``dynamic_sampling.py``)."""
