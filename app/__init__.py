"""llm-lanes: LLM serving on Ray Serve with hot and cold lanes."""
