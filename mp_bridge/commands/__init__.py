"""Sub-commands of the ``mp-bridge`` CLI, one module each."""
