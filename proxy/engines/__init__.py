"""Inference engines behind one protocol: token ids and sampling parameters in, sampled ids out."""
