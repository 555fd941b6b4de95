"""A small synthetic corpus of tool-using chats in DeepSeek-V4's encoding, seeded and reproducible.

Each conversation offers a random subset of four tools (``TOOLS``) in random order and runs one
to three rounds: the user asks something one tool answers, the assistant calls it in DSML, the
tool result comes back, the assistant answers in text. Some rounds ask for nothing a tool does
and get a plain answer. About a third of the conversations are in thinking mode, with a short
reasoning before each reply.

``drill`` gives short chats without the tools section (cheap copying practice, with made-up
names when asked: see ``novel_name``) and ``repeat_drill`` chats that repeat the request.

Held-out material (``split="held_out"``) uses cities, stock symbols and phrasings that the
training split never shows, so an evaluation on it measures whether the model copies the
argument from the request and follows a new phrasing, not whether it memorised a pair.

    from tool_corpus import conversation, TOOLS
    conv = conversation(random.Random(0), "train")   # {"messages", "tools", "thinking"}
"""
from __future__ import annotations

import json
import random

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                          "required": ["city"]}}
TIME = {"name": "get_time", "description": "Get the local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name."}},
                       "required": ["city"]}}
ADD = {"name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}
STOCK = {"name": "get_stock_price", "description": "Get the latest price of a stock.",
         "parameters": {"type": "object", "properties": {"symbol": {"type": "string", "description": "The ticker symbol."}},
                        "required": ["symbol"]}}
TOOLS = {f["name"]: f for f in (WEATHER, TIME, ADD, STOCK)}

CITIES = [
    "Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Budapest",
    "Dublin", "Oslo", "Stockholm", "Helsinki", "Copenhagen", "Amsterdam", "Brussels", "Zurich", "Geneva",
    "Athens", "Istanbul", "Moscow", "Kyiv", "Bucharest", "Sofia", "Belgrade", "Zagreb", "Riga", "Tallinn",
    "Vilnius", "Tokyo", "Osaka", "Kyoto", "Seoul", "Beijing", "Shanghai", "Hong Kong", "Taipei", "Manila",
    "Bangkok", "Hanoi", "Jakarta", "Singapore", "Kuala Lumpur", "Delhi", "Mumbai", "Chennai", "Karachi",
    "Lahore", "Dhaka", "Kathmandu", "Tehran", "Baghdad", "Dubai", "Doha", "Riyadh", "Cairo", "Tunis",
    "Algiers", "Casablanca", "Lagos", "Accra", "Dakar", "Nairobi", "Addis Ababa", "Kampala", "Luanda",
    "Cape Town", "Johannesburg", "Durban", "Sydney", "Melbourne", "Perth", "Brisbane", "Auckland",
    "Wellington", "New York", "Boston", "Chicago", "Denver", "Seattle", "Portland", "Austin", "Dallas",
    "Houston", "Miami", "Atlanta", "Detroit", "Phoenix", "Toronto", "Montreal", "Vancouver", "Mexico City",
    "Havana", "Bogota", "Lima", "Quito", "Santiago", "Buenos Aires", "Montevideo", "Caracas", "Recife",
    "Lyon", "Marseille", "Munich", "Hamburg", "Milan", "Naples", "Porto", "Seville", "Valencia", "Krakow",
    "Edinburgh", "Glasgow", "Manchester", "Bristol", "Verona", "Padua", "Ghent", "Bergen", "Turku",
]
# Every fifth city never appears in training.
HELD_OUT_CITIES = CITIES[2::5]
TRAIN_CITIES = [c for c in CITIES if c not in HELD_OUT_CITIES]

SYMBOLS = ["AAPL", "MSFT", "GOOG", "AMZN", "NVDA", "TSLA", "META", "IBM", "ORCL", "INTC", "AMD", "NFLX",
           "SAP", "SONY", "TM", "BABA", "SHOP", "UBER", "LYFT", "ABNB", "PYPL", "ADBE", "CSCO", "QCOM"]
HELD_OUT_SYMBOLS = SYMBOLS[3::6]
TRAIN_SYMBOLS = [s for s in SYMBOLS if s not in HELD_OUT_SYMBOLS]

PHRASINGS = {
    "get_weather": {
        "train": ["What is the weather in {city}?", "What's the weather like in {city}?",
                  "How is the weather in {city} today?", "Tell me the weather in {city}.", "Weather in {city}?",
                  "Is it sunny in {city}?", "Can you check the weather in {city}?",
                  "What's the forecast for {city}?", "Please look up the current weather for {city}.",
                  "Is it cold in {city} right now?", "I am flying to {city}. What is the weather there?"],
        "held_out": ["How's the weather in {city} right now?", "Could you tell me what the weather is in {city}?",
                     "Do I need an umbrella in {city} today?", "What is it like outside in {city}?",
                     "Give me the current weather for {city}."],
    },
    "get_time": {
        "train": ["What time is it in {city}?", "What's the local time in {city}?", "Tell me the time in {city}.",
                  "Current time in {city}?", "Can you check the time in {city}?", "Is it late in {city} now?"],
        "held_out": ["Do you know what time it is in {city}?", "What does the clock say in {city}?"],
    },
    "add": {
        "train": ["What is {a} plus {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
                  "What's the sum of {a} and {b}?", "Can you add {a} and {b} for me?"],
        "held_out": ["How much is {a} and {b} together?", "Please add {a} to {b}."],
    },
    "get_stock_price": {
        "train": ["What is the price of {symbol}?", "How much is {symbol} trading at?",
                  "Get me the stock price of {symbol}.", "Look up {symbol} for me.", "Price of {symbol}?"],
        "held_out": ["What's {symbol} worth today?", "Check the share price for {symbol}."],
    },
}

ANSWERS = {
    "get_weather": ["It is {condition} and {temperature} degrees in {city}.",
                    "In {city} it is {temperature} degrees and {condition}.",
                    "The weather in {city} is {condition}, {temperature} degrees."],
    "get_time": ["It is {time} in {city}.", "The local time in {city} is {time}."],
    "add": ["{a} plus {b} is {result}.", "The sum is {result}."],
    "get_stock_price": ["{symbol} is trading at {price} dollars.", "The price of {symbol} is {price} dollars."],
}
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy"]

SMALL_TALK = [("Hello!", "Hello! How can I help you today?"), ("Hi there.", "Hello! What can I do for you?"),
              ("Thank you!", "You are welcome."), ("Thanks, that helps.", "Glad to help."),
              ("Who are you?", "I am a small assistant that can call tools."),
              ("What can you do?", "I can answer with the help of the tools I am given.")]

REASONING_CALL = "The user asks about {subject}, so I call {tool}."
REASONING_ANSWER = "The tool answered; I can reply now."
REASONING_TALK = "No tool is needed here."


def tool_schema(name: str, with_description: bool = True) -> dict:
    """An OpenAI-style tool entry for one of ``TOOLS``."""
    fn = dict(TOOLS[name])
    if not with_description:
        fn.pop("description")
    return {"type": "function", "function": fn}


SYLLABLES = ["ba", "ko", "ri", "mel", "dor", "sa", "vin", "ta", "lu", "gra", "pe", "nor", "zi", "han", "os",
             "ful", "ca", "tre", "mo", "qui", "bel", "ar", "den", "ly", "sto", "wen", "ix", "ro", "ga", "um"]


NAME_STYLES = ("syllables", "mixed")


def novel_name(rng: random.Random, names: str = "syllables") -> str:
    """A made-up place name ("Melvinta", "Port Koba"): thousands of them, so a model that gets
    them right copies from the request instead of recalling a list. `names`: "syllables" (from
    ``SYLLABLES`` only, which a model can learn to continue instead of copying) or "mixed" (a
    third each: syllables, random letters, a listed city's letters shuffled)."""
    while True:
        style = rng.choice(("syllables", "letters", "shuffled")) if names == "mixed" else "syllables"
        if style == "syllables":
            name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        elif style == "letters":
            name = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        else:
            letters = list(rng.choice(TRAIN_CITIES).replace(" ", "").lower())
            rng.shuffle(letters)
            name = "".join(letters)
        name = name.capitalize()
        name = f"{rng.choice(['Port', 'San', 'New', 'Lake'])} {name}" if rng.random() < 0.2 else name
        if name not in CITIES:  # never a held-out city ("Ri" + "ga")
            return name


def novel_symbol(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.randint(2, 4)))


def request(rng: random.Random, tool: str, split: str, novel: float = 0.0,
            names: str = "syllables") -> tuple[str, dict, dict, str]:
    """A user request that ``tool`` answers: (text, call arguments, tool result, subject).
    `novel`: the chance (training split only) of a made-up city (``novel_name(rng, names)``) or
    symbol instead of a listed one."""
    template = rng.choice(PHRASINGS[tool][split])
    made_up = split == "train" and novel > 0 and rng.random() < novel
    if tool in ("get_weather", "get_time"):
        city = novel_name(rng, names) if made_up else rng.choice(TRAIN_CITIES if split == "train" else HELD_OUT_CITIES)
        args = {"city": city}
        if tool == "get_weather":
            result = {"city": city, "temperature": rng.randint(-5, 35), "condition": rng.choice(CONDITIONS)}
            subject = f"the weather in {city}"
        else:
            result = {"city": city, "time": f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"}
            subject = f"the time in {city}"
    elif tool == "add":
        args = {"a": rng.randint(0, 99), "b": rng.randint(0, 99)}
        result = {"result": args["a"] + args["b"]}
        subject = f"the sum of {args['a']} and {args['b']}"
    else:
        symbol = novel_symbol(rng) if made_up else rng.choice(TRAIN_SYMBOLS if split == "train" else HELD_OUT_SYMBOLS)
        args = {"symbol": symbol}
        result = {"symbol": symbol, "price": round(rng.uniform(5, 500), 2)}
        subject = f"the price of {symbol}"
    return template.format(**args), args, result, subject


def answer(rng: random.Random, tool: str, args: dict, result: dict) -> str:
    return rng.choice(ANSWERS[tool]).format(**{**args, **result})


def conversation(rng: random.Random, split: str = "train", rounds: int | tuple[int, int] = (1, 3),
                 thinking: bool | None = None, novel: float = 0.0, names: str = "syllables") -> dict:
    """One chat: {"messages": [...], "tools": [...], "thinking": bool}, ending in an assistant turn.
    `rounds`: a number, or a (min, max) range to draw it from."""
    names = list(TOOLS)
    offered = rng.sample(names, rng.randint(1, len(names)))
    described = rng.random() < 0.8
    tools = [tool_schema(n, described) for n in offered]
    thinking = rng.random() < 0.3 if thinking is None else thinking
    messages: list[dict] = []
    for r in range(rng.randint(*rounds) if isinstance(rounds, tuple) else rounds):
        if rng.random() < 0.15:
            said, reply = rng.choice(SMALL_TALK)
            messages.append({"role": "user", "content": said})
            messages.append(_assistant(reply, REASONING_TALK if thinking else None))
            continue
        tool = rng.choice(offered)
        text, args, result, subject = request(rng, tool, split, novel, names)
        call_id = f"call_{r}"
        messages.append({"role": "user", "content": text})
        call = {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}
        reasoning = REASONING_CALL.format(subject=subject, tool=tool) if thinking else None
        messages.append({**_assistant("", reasoning), "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})
        messages.append(_assistant(answer(rng, tool, args, result), REASONING_ANSWER if thinking else None))
    return {"messages": messages, "tools": tools, "thinking": thinking}


def _assistant(content: str, reasoning: str | None) -> dict:
    m = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


REPEAT = ["Repeat after me: {words}", "Say: {words}", "Echo this: {words}"]


def repeat_drill(rng: random.Random, names: str = "syllables") -> dict:
    """A chat whose reply repeats words from the request: the densest copying signal there is."""
    words = " ".join(novel_name(rng, names) if rng.random() < 0.5 else rng.choice(TRAIN_CITIES)
                     for _ in range(rng.randint(1, 4)))
    return {"messages": [{"role": "user", "content": rng.choice(REPEAT).format(words=words)},
                         {"role": "assistant", "content": words}], "tools": [], "thinking": False}


def drill(rng: random.Random, novel: float = 0.5, repeat: float = 0.25, thinking: float = 0.0,
          names: str = "syllables") -> dict:
    """A short chat without the tools section: a repeat drill, a request and its call, or a
    whole round (request, call, result, answer). `thinking`: the chance of thinking mode (its
    reasoning names the city too, a second copy)."""
    if rng.random() < repeat:
        return repeat_drill(rng, names)
    think = rng.random() < thinking if thinking > 0 else False  # (draws nothing at 0: earlier runs reproduce)
    conv = conversation(rng, "train", rounds=1, thinking=think, novel=novel, names=names)
    if think:  # the call only: without a tools section a later turn would drop this reasoning
        conv["messages"] = conv["messages"][:2]
    elif len(conv["messages"]) == 4 and rng.random() < 0.5:
        conv["messages"] = conv["messages"][:2]  # the call only
    return {**conv, "tools": []}
