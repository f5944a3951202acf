"""On-policy distillation math: per-token losses against a frozen teacher (``losses``) and the
objective they enter, as a policy-gradient advantage or as a loss backpropagated directly
(``objective``). Pure torch; docs/algorithms.md "On-policy distillation" has the formulas."""
