"""Batch dispatch mode: engines that run whole batches in a fixed time.

`dispatcher.BatchDispatcher` is the functional core; `simulate` (virtual time) and `runtime`
(asyncio, wall clock) are its two shells; `plan` turns the capacity arithmetic and simulated
percentiles into a worker count.
"""
