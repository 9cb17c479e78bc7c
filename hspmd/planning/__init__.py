"""Planning: cluster and model descriptions, the cost model and simulator, strategy searches."""
