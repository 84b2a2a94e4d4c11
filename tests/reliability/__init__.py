"""Reliability tests: kills, corruption, hostile inputs, full disks, concurrent writers."""
