"""Recorded calls turned into what trainers consume."""
