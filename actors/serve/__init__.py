"""Everything Ray Serve runs: the async engine, strategy deployments, the OpenAI ingress, the app builder."""
