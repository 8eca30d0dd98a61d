"""Acceptance and speed measurement in eyas engine: the measuring loop, the stage, its reports."""
