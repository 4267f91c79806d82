"""Checkpoints: the layout of a ``--save`` directory, its atomic commit, and the pieces every
backend's checkpoint shares. Below the backends, the flag checks and the loop, which all use it.

- ``layout``: the names (tracker ``latest_checkpointed_iteration.txt``, ``iter_NNNNNNN``,
  ``.partial``, ``loop_state.json``) and their readers (``latest_step``, ``resume_step``,
  ``resolve``, ``written_by``);
- ``commit``: the atomic save (``begin_save`` -> every rank writes -> ``commit_save``, which checks
  every rank's files are visible), ``retain`` (``--save-retain``), ``move_checkpoints_aside``
  (``--overwrite-save``), ``remove_partial``;
- ``pending_rollout``: the rollout an overlapped run generated ahead (``pending_rollout.pt``);
- ``disk_space``: what a checkpoint needs and whether a failed save ran out of room;
- ``rng_state``: the random state of Python, NumPy, torch and CUDA, as both backends save it;
- ``compat``: is a checkpoint's model this run's model (``check_same_model``, before loading);
- ``written_files``: the files one rank wrote (the DCP writer that records them);
- ``run_settings``: the settings ``loop_state.json`` records, and the note a resume with other ones prints.

What the loop does with these at save and resume time (which ranks write, what ``loop_state.json``
holds, the consistency of a resumed run) is the loop's: ``rl_plugin.loop.resume``.
"""
