"""The HTTP routes of `q3tts serve`, one module per surface, each with its own `router = APIRouter()`: speech,
voices, the WebSocket protocols, health / metrics / status, and the playground page."""
