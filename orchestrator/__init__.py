"""The pure decision core of monitord: models, migration phase table, reconcile planner,
cleanup policy and error catalogue. No I/O, no clock reads, no asyncio: callers pass
state, observations and `now` in and get new state plus actions back."""
