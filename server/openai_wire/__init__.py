"""The OpenAI-shaped wire: request bodies declared once, as pydantic models.

Parsing, error messages, defaults and the OpenAPI document all come from these models; they
convert themselves to the engine-neutral values the rest of the server uses. Nothing here
knows Starlette.
"""
