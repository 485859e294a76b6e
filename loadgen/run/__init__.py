"""Sending traffic: cells, prompts, Locust users, the runner and its workers, the local service."""
