"""The HTTP surface both servers speak: request bodies (validated pydantic models that
also generate /openapi.json), the error envelope, and a server process's lifecycle."""
