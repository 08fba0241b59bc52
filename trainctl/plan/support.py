"""Temporary shim: the support matrix moved to trainctl.core.support (cli.py still imports it here)."""

from trainctl.core.support import unsupported  # noqa: F401
