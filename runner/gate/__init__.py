"""The admission gate: the window (gate.py), the order a policy reads the agents in
(gate_order.py), the holders' tool calls for the policies that ask (tool_calls.py), one
window per DP rank (ranked_gate.py), the control loop that feeds the policy (control.py),
and the task order of a batch (ordering.py).

May import: engines.protocol (the signals' types), policies.protocol. Never a policy's
module, never the registry: the batch hands the gate a built policy.
"""
