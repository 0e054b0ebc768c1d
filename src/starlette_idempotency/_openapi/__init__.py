"""The middleware in a FastAPI app's OpenAPI schema, by idea: what it adds to an operation
(:mod:`.documenter`), the schema fragments that make it up (:mod:`.fragments`), and where the
additions enter the app's ``openapi()``, before and after startup (:mod:`.install`)."""
