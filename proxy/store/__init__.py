"""Durable record of sessions, segments and engine calls; the only place that speaks SQL."""
