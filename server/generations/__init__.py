"""One generation's life: its run and event log (`run`), and the store that finds it again."""
