"""Eviction policies: one file and one class each, plus conf/policy/<name>.yaml naming the class in `_target_`."""
