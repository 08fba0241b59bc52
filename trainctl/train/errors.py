"""Exceptions the worker raises for problems a user can cause (as opposed to our bugs)."""


class WorkerConfigError(Exception):
    """The run directory asks for something this worker cannot do; the message is one line naming the key."""
