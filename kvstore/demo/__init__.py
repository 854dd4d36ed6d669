"""The demo: a scripted agent workload on a random-weight model built on the spot.

Rooms: workload (the users, their turns, the restart, the summary) and model
(the offline tokenizer and random-weight mlx-lm model, which the tests use
too).  `kvstore demo` (kvstore.cli) runs it.
"""
