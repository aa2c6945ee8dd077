"""The scheduler layer: a functional core (no asyncio, no wall clock) and its shells."""
