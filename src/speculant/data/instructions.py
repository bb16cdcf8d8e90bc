"""Instruction prompts for distillation data, made here from what the interpreter ships (no download).

Direct Alignment (Goel et al. 2024) fine-tunes a drafter on the target's own answers to instruction prompts. The
prompts only have to make the target write the kinds of text it writes for users; they are never the
evaluation prompts (MT-Bench questions are not used or imitated one by one). Kinds, cycled so every kind is
represented in any prefix of the list:

``code``       write a function given its signature and what its docstring says (training-split stdlib modules);
``explain``    explain a stdlib module, function or a pydoc topic (the language reference's sections);
``rewrite``    summarise, simplify, list the key points of, or write questions about a docstring paragraph;
``writing``    emails, stories, poems, speeches, advice and comparisons on everyday subjects (word lists below);
``reasoning``  arithmetic word problems and unit conversions with random numbers, step by step;
``knowledge``  short questions on science, history and geography subjects from the word lists.

Each prompt is ``{"messages": [{"role": "user", "content": ...}], "kind": ...}``; :func:`instruction_prompts` is
deterministic for a seed.
"""

from __future__ import annotations

import ast
import random
import textwrap

from .corpus import load_corpus

__all__ = ["instruction_prompts", "KINDS"]

KINDS = ("code", "explain", "rewrite", "writing", "reasoning", "knowledge")

_SUBJECTS = (
    "learning a new language", "remote work", "city gardening", "saving money", "a first marathon",
    "moving to a new city", "cooking for a family", "public libraries", "electric cars", "team meetings",
    "job interviews", "volunteering", "sleep habits", "learning to code", "travelling by train",
    "a small bakery", "recycling at home", "renting an apartment", "starting a podcast", "hiking safety",
    "online privacy", "a school science fair", "adopting a dog", "time management", "a birthday party",
    "climate change", "the history of the bicycle", "museums", "board games", "photography",
    "a customer complaint", "a new product launch", "a charity run", "healthy breakfasts", "public speaking",
)
_SCIENCE = (
    "photosynthesis", "the water cycle", "gravity", "black holes", "vaccines", "plate tectonics", "DNA",
    "electric circuits", "the immune system", "sound waves", "magnetism", "the greenhouse effect",
    "cell division", "chemical bonds", "the speed of light", "erosion", "nuclear fusion", "antibiotics",
    "the periodic table", "ocean tides", "volcanoes", "the human heart", "evolution", "semiconductors",
)
_HUMANITIES = (
    "the Roman Empire", "the printing press", "the Renaissance", "the industrial revolution", "democracy",
    "the Silk Road", "ancient Egypt", "the French Revolution", "impressionist painting", "the Olympic Games",
    "Shakespeare's plays", "the invention of writing", "world trade", "the Cold War", "classical music",
)
_WRITING = (
    "Write a short, friendly email to a colleague about {s}.",
    "Write a persuasive paragraph in favour of {s}.",
    "Give me five practical tips about {s}.",
    "Write a short story (under 200 words) that involves {s}.",
    "Write a four-line poem about {s}.",
    "What are the pros and cons of {s}? Answer in a short list.",
    "Draft a short speech for a community event about {s}.",
    "Write a product description for an app that helps with {s}.",
    "Pretend you are a tour guide and tell me about {s}.",
    "Write a blog post introduction about {s}.",
    "Imagine you are a radio host. Introduce today's show about {s}.",
    "Act as a patient teacher and answer a student who asks you about {s}.",
    "You are a travel agent. Convince a hesitant customer to try {s}.",
    "Write a dialogue between two friends who disagree about {s}.",
    "Write a formal letter to a local newspaper about {s}.",
)
_KNOWLEDGE = (
    "Explain {s} to a ten-year-old.",
    "What is {s}? Give a short, accurate answer.",
    "Describe the most important facts about {s}.",
    "Why does {s} matter? Explain in a few sentences.",
    "Write three quiz questions about {s}, with answers.",
    "What are common misconceptions about {s}?",
    "Compare {s} with a related idea, in a short paragraph.",
)
_REWRITE = (
    "Summarise the following text in one or two sentences:\n\n{t}",
    "Rewrite the following text in simpler words:\n\n{t}",
    "List the key points of the following text as bullet points:\n\n{t}",
    "Write two questions that the following text answers:\n\n{t}",
    "Fix the grammar and make the following text more concise:\n\n{t}",
    "Extract every technical term from the following text and define each in a few words:\n\n{t}",
    "Return a JSON object with the main topic and three keywords of the following text:\n\n{t}",
)
_EXPLAIN = (
    "What is the Python `{m}` module used for? Give a short example.",
    "Explain what `{m}.{f}` does in Python and when to use it.",
    "How do I use `{m}` in Python? Show a small example.",
)
_TOPIC = (
    "Explain this part of the Python language reference in plain words:\n\n{t}",
    "Based on the following documentation, what should a Python beginner remember?\n\n{t}",
)
_CODE = (
    "Write a Python function `{sig}` that {what}",
    "Implement `{sig}` in Python. It should {what}",
    "Can you write Python code for `{sig}`? The function should {what}",
)


def _first_sentence(doc: str) -> str:
    first = " ".join(doc.strip().split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".") + "."


def _functions(docs) -> list[tuple[str, str, str]]:
    """``(module, signature, docstring)`` of documented public functions in the given modules."""
    found = []
    for doc in docs:
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                text = ast.get_docstring(node)
                if text and 20 <= len(text) and len(_first_sentence(text)) >= 20:
                    sig = f"{node.name}({ast.unparse(node.args)})"
                    if len(sig) <= 80:
                        found.append((doc.module, sig, text))
    return found


def _paragraphs(texts, lo: int = 200, hi: int = 900) -> list[str]:
    """Prose paragraphs of ``lo..hi`` characters (no code: few symbols)."""
    out = []
    for text in texts:
        for para in text.split("\n\n"):
            para = textwrap.dedent(para).strip()
            flat = " ".join(para.split())
            symbols = sum(c in "{}[]()=<>*#_`|\\" for c in flat)
            if lo <= len(flat) <= hi and symbols < len(flat) * 0.02 and flat[0].isupper():
                out.append(flat)
    return out


def instruction_prompts(n: int, seed: int = 0) -> list[dict]:
    """``n`` instruction prompts, kinds interleaved, deterministic for ``seed``. Uses the training split of the
    stdlib corpus only (the same split rule as the bundled models' data)."""
    rng = random.Random(seed)
    corpus = load_corpus()
    train_modules = [d for d in corpus if d.split == "train" and not d.top.startswith("pydoc:")]
    topics = [d for d in corpus if d.split == "train" and d.top.startswith("pydoc:")]
    funcs = _functions(train_modules)
    docstrings = [f[2] for f in funcs]
    paragraphs = _paragraphs(docstrings + [d.text for d in topics])
    topic_paras = _paragraphs([d.text for d in topics], 200, 700)
    modules = sorted({d.module for d in train_modules if "." not in d.module and not d.module.startswith("_")})
    rng.shuffle(funcs)
    rng.shuffle(paragraphs)

    def code(i: int) -> str:
        _, sig, text = funcs[i % len(funcs)]
        what = _first_sentence(text)
        return rng.choice(_CODE).format(sig=sig, what=what[0].lower() + what[1:])

    def explain(i: int) -> str:
        if i % 3 == 2 and topic_paras:
            return rng.choice(_TOPIC).format(t=rng.choice(topic_paras))
        module, sig, _ = funcs[(i * 7) % len(funcs)]
        template = rng.choice(_EXPLAIN)
        return template.format(m=module if "{f}" in template else rng.choice(modules), f=sig.split("(")[0])

    def rewrite(i: int) -> str:
        return rng.choice(_REWRITE).format(t=paragraphs[i % len(paragraphs)])

    def writing(i: int) -> str:
        return rng.choice(_WRITING).format(s=rng.choice(_SUBJECTS))

    def reasoning(i: int) -> str:
        a, b, c = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 9)
        return rng.choice((
            f"A shop sells pencils at {b} cents each. How much do {a} pencils cost in dollars? Think step by step.",
            f"Tom has {a} apples, gives away {b} and then buys {c} bags of {b} apples. How many does he have now? "
            "Explain your reasoning.",
            f"A train travels {a * 10} km in {c} hours. What is its average speed? Show the steps.",
            f"Convert {a} degrees Celsius to Fahrenheit, and explain the formula.",
            f"What is {a} multiplied by {b}, minus {c}? Show your work.",
            f"If a rectangle is {a} cm long and {b} cm wide, what are its area and perimeter?",
            f"Solve for x: {c}x + {b} = {a + b}. Explain each step.",
        ))

    def knowledge(i: int) -> str:
        subject = rng.choice(_SCIENCE if i % 2 == 0 else _HUMANITIES)
        return rng.choice(_KNOWLEDGE).format(s=subject)

    makers = {"code": code, "explain": explain, "rewrite": rewrite, "writing": writing, "reasoning": reasoning,
              "knowledge": knowledge}
    rows, seen = [], set()
    i = 0
    while len(rows) < n and i < 20 * n:
        kind = KINDS[i % len(KINDS)]
        text = makers[kind](i // len(KINDS))
        i += 1
        if text in seen:
            continue
        seen.add(text)
        rows.append({"messages": [{"role": "user", "content": text}], "kind": kind})
    return rows
