"""Runtime support for fxsplit: graph capture wrappers and the CPU capture emulator."""
