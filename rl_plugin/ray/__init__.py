"""Ray actors of the RL loop: the training group (one actor per rank) and the rollout manager."""
