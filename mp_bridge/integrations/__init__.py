"""Glue to other frameworks. Import the submodule you need (``mp_bridge.integrations.megatron``);
this package imports nothing heavy."""

__all__: list[str] = []
