"""veriloop environments: Gymnasium verifier environments (no torch needed)."""
