"""Benchmark tasks. Each task is one module plus one conf/task/<name>.yaml whose `_target_` names its class."""
