"""One replica: domain types, engine, model runner, KV cache, planner, performance model."""
