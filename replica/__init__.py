"""One replica: domain types, engine, model runner, KV cache, planner, performance model."""

from replica import compiled

compiled.use()
