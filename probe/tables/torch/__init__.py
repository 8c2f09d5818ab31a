"""Tables about PyTorch in the target, and the checkpoint it can write.

Nothing here imports torch: each table takes torch from ``sys.modules`` when the target has imported
it, and says so in a clear error when it has not. Every table reads live state from the agent's thread:
no collective, no device synchronisation, and a bound in time on every scan.
"""
