"""The phased engine: the step cut into phases run one after another, each phase's
weights streamed in from the host tier and its gradients streamed back out."""
