"""What every other package may use: the configuration's model and how it is loaded.

`server.core` imports nothing else of Sluice's."""
