"""The EAGLE-3 drafter: one Llama-style layer over fused target features, its TTT forward and draft step."""
