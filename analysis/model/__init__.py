"""The capacity model: batch capacity, the step-cost model, its backtest, the queue per replica."""
