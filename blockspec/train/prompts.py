"""User prompts for on-policy training data: the target answers them and the draft learns its answers.

Built offline from templates, hand-written topic lists and the CPython standard library, covering what
a chat model is asked (code, writing, role-play, reasoning, arithmetic, extraction, science, humanities).
Never from the benchmark sets (HumanEval, MT-Bench). Every fifth topic and the stdlib modules in
data.HELDOUT_MODULES are kept for the held-out split, so held-out prompts share no topic with training.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path

CODE_TASKS = (
    "Explain what this Python code does:\n\n```python\n{code}\n```",
    "Write a docstring for the following Python code:\n\n```python\n{code}\n```",
    "Continue this Python code:\n\n```python\n{code}\n```",
    "Review this Python code and suggest improvements:\n\n```python\n{code}\n```",
    "Write a short unit test for this Python code:\n\n```python\n{code}\n```",
    "Rewrite this Python code to be simpler and more readable:\n\n```python\n{code}\n```",
)
IMPLEMENT_TASKS = (
    "Complete the following Python function:\n```python\n{stub}\n```",
    "Implement this function in Python:\n```python\n{stub}\n```",
    "Write the body of this Python function so that it does what its docstring says:\n"
    "```python\n{stub}\n```",
)
WRITING = (
    "Write a short poem about {t}.", "Write a blog post about {t}.", "Write a persuasive essay on {t}.",
    "Write a short story that involves {t}.", "Write a product description for something related to {t}.",
    "Draft an email to a colleague about {t}.", "Write a speech for a school assembly about {t}.",
    "Write a haiku about {t}.", "Write a travel diary entry that mentions {t}.",
)
ROLEPLAY = (
    "Pretend you are a {r}. Tell me about {t}.", "Act as a {r} and give me advice about {t}.",
    "You are a {r}. Describe a typical day and how {t} plays a part in it.",
    "Imagine you are a {r} being interviewed about {t}. Answer the first question.",
)
EXPLAIN = (
    "Explain {t} to a high school student.", "What are the main ideas behind {t}?",
    "Give three interesting facts about {t}.", "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few paragraphs.", "How would you teach {t} to a beginner?",
    "Compare {t} with {u}.",
)
EXTRACT = (
    "Summarize the following text in one sentence:\n\n{p}",
    "List the key terms in the following text as a JSON array:\n\n{p}",
    "Write three questions that the following text answers:\n\n{p}",
    "Rewrite the following text in simpler words:\n\n{p}",
)
TOPICS = (
    "the ocean", "climate change", "photosynthesis", "the French Revolution", "black holes", "gardening",
    "machine learning", "the Roman Empire", "coffee", "renewable energy", "friendship", "volcanoes",
    "the stock market", "chess", "the human immune system", "jazz music", "recycling", "the moon landing",
    "healthy sleep", "electric cars", "ancient Egypt", "honeybees", "the internet", "supply and demand",
    "the water cycle", "Shakespeare", "vaccines", "mountain climbing", "time management", "DNA",
    "the Renaissance", "social media", "public libraries", "earthquakes", "the printing press", "meditation",
    "rain forests", "inflation", "the Olympic Games", "cryptography", "bread baking", "plate tectonics",
    "democracy", "the solar system", "learning a new language", "urban planning",
    "the Industrial Revolution", "nutrition", "artificial intelligence", "dinosaurs",
    "impressionist painting", "the Great Wall of China", "remote work", "quantum computing", "bicycles",
    "the Silk Road", "volunteering", "glaciers",
    "the theory of evolution", "minimalism", "space exploration", "board games", "the periodic table",
    "migration of birds", "classical music", "the Cold War", "architecture", "cloud computing",
    "the scientific method", "desert ecosystems", "smartphones", "ancient Greek philosophy", "tea",
    "wind turbines", "the human brain", "budgeting", "the printing of money", "coral reefs",
    "open source software", "photography", "the Middle Ages", "electricity", "marathon running",
    "the history of writing", "probability", "cooking pasta", "trains", "ethics of technology", "penguins",
)
ROLES = (
    "pirate captain", "medieval knight", "software engineer", "detective", "chef", "astronaut",
    "museum guide", "kindergarten teacher", "travel agent", "farmer", "doctor", "film director",
)
ITEMS = ("apples", "books", "marbles", "tickets", "cookies", "pencils", "stamps", "coins")
# Specific, multi-constraint requests as people write them (the benchmarks' style, none of their text).
FORMS = ("a cover letter", "a product review", "a restaurant review", "a short news article",
         "a tweet thread", "a limerick", "a dialogue between two friends", "a recipe",
         "a three-day itinerary", "a lesson plan", "an FAQ section", "a press release",
         "a motivational speech", "a letter to the editor", "a short fable")
AUDIENCES = ("children aged eight", "busy parents", "university students", "retired teachers",
             "a job interviewer", "first-time travellers", "small business owners", "software developers",
             "a local newspaper")
CONSTRAINTS = ("Keep it under 150 words.", "Use exactly three bullet points.", "Give it a catchy title.",
               "Write in a formal tone.", "Make it humorous.", "End with a question to the reader.",
               "Include one concrete example.", "Avoid technical jargon.", "Use a numbered list.",
               "Start every sentence with a different letter.", "Write it in the second person.")
CODE_GOALS = ("reverses the words in a sentence", "checks whether a string is a palindrome",
              "merges two sorted lists", "counts the vowels in a text", "returns the n-th Fibonacci number",
              "finds all primes below n", "parses a CSV line into fields", "computes the median of a list",
              "flattens a nested list", "removes duplicate items while keeping their order",
              "converts Roman numerals to integers", "finds the longest common prefix of several strings",
              "validates an email address", "groups words that are anagrams",
              "computes the edit distance of two strings")
LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C++", "Java", "Rust", "Go", "Bash")
NAMES = ("Alice", "Bob", "Chen", "Dana", "Emeka", "Farah", "Gustav", "Hana", "Ivan", "Julia", "Kofi",
         "Leila")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Denver", "Krakow", "Lima", "Hanoi", "Toronto", "Cairo", "Oslo")
SITUATIONS = ("a customer complains that an order arrived late",
              "a new colleague asks for help on the first day", "a storm cancels the plans for the day",
              "someone asks you to explain your job at a party", "you must give bad news to a friend",
              "a reporter asks about a mistake you made")


def _split(values: tuple[str, ...], heldout: bool) -> list[str]:
    return [v for i, v in enumerate(values) if (i % 5 == 4) == heldout]


def arithmetic_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
    item, kind = rng.choice(ITEMS), rng.randrange(5)
    if kind == 0:
        return (f"Tom has {a} {item}. He buys {b} more and then gives away {c}. "
                f"How many {item} does he have now?")
    if kind == 1:
        return f"Solve for x: {c}x + {a} = {a + c * b}. Show your steps."
    if kind == 2:
        return (f"A box holds {c} rows of {b} {item}. How many {item} are in {a} boxes? "
                f"Explain your reasoning.")
    if kind == 3:
        return f"What is the sum of all integers from 1 to {a * c}? Explain how you got the answer."
    return f"If a train travels {a * 10} km in {c} hours, what is its average speed? Show the calculation."


def detailed_prompt(rng: random.Random, topics: list[str], roles: list[str]) -> str:
    """One specific request: writing with an audience and constraints, a coding task, a logic puzzle, a
    numeric STEM question, an extraction over a made-up record, or a role-play situation."""
    kind, t = rng.randrange(6), rng.choice(topics)
    if kind == 0:
        return (f"Write {rng.choice(FORMS)} for {rng.choice(AUDIENCES)} about {t}. "
                + " ".join(rng.sample(CONSTRAINTS, rng.randint(1, 2))))
    if kind == 1:
        extra = rng.choice(("", " Include a short docstring.", " Explain its time complexity.",
                            " Add two example calls.", " Do not use any library functions."))
        return f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_GOALS)}.{extra}"
    if kind == 2:
        a, b, c = rng.sample(NAMES, 3)
        trait = rng.choice(("taller", "older", "faster", "richer"))
        return rng.choice((f"{a} is {trait} than {b}, and {b} is {trait} than {c}. "
                           f"Who is the least {trait[:-2]}? Explain your reasoning step by step.",
                           f"{a}, {b} and {c} each own a different pet: a cat, a dog and a parrot. "
                           f"{a} is allergic to fur and {b} does not own the dog. Who owns which pet?"))
    if kind == 3:
        x, y = rng.randint(2, 30), rng.randint(2, 12)
        return rng.choice((f"A car accelerates from rest at {x} m/s^2 for {y} seconds. "
                           f"How far does it travel?",
                           f"What is the derivative of f(x) = {x}x^3 - {y}x + 7? Show each step.",
                           f"You invest ${x * 100} at {y}% annual interest, compounded yearly. "
                           f"How much do you have after 3 years?",
                           f"Find the area of a triangle with base {x} cm and height {y} cm.",
                           f"A solution contains {x} g of salt in {y * 100} mL of water. "
                           f"What is its concentration in g/L?"))
    if kind == 4:
        a, b = rng.sample(NAMES, 2)
        record = (f"On {rng.randint(1, 28)} March, {a} from {rng.choice(CITIES)} met {b} from "
                  f"{rng.choice(CITIES)} to discuss {t}. They agreed on a budget of "
                  f"${rng.randint(2, 90)},000 and a deadline of {rng.randint(1, 28)} June.")
        return rng.choice((f"Extract every person, city, amount and date from this text as JSON:\n\n"
                           f"{record}",
                           f"Summarize this note in one sentence, then list its action items:\n\n{record}"))
    return (f"Imagine you are a {rng.choice(roles)} and {rng.choice(SITUATIONS)}. "
            f"How do you respond, and why?")


def implement_stubs(files: list[Path], rng: random.Random, want: int) -> list[str]:
    """Up to `want` 'def ...: docstring' stubs of documented stdlib functions."""
    stubs: list[str] = []
    for path in rng.sample(files, min(len(files), 4 * want)):
        if len(stubs) >= want:
            break
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and ast.get_docstring(n)
                 and not n.name.startswith("_") and len(ast.get_docstring(n)) < 600]
        if funcs:
            node = rng.choice(funcs)
            args = ast.unparse(node.args)
            doc = "\n    ".join(ast.get_docstring(node).splitlines())
            stubs.append(f'def {node.name}({args}):\n    """{doc}\n    """')
    return stubs


def code_snippet(files: list[Path], rng: random.Random, max_lines: int = 30) -> str | None:
    lines = rng.choice(files).read_text(encoding="utf-8", errors="replace").splitlines()
    heads = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
    if not heads:
        return None
    first = rng.choice(heads)
    return "\n".join(lines[first : first + rng.randint(6, max_lines)]).rstrip()


def paragraphs(files: list[Path], rng: random.Random, want: int) -> list[str]:
    """Plain-prose paragraphs (80-700 chars) from the pydoc sources, if installed."""
    out: list[str] = []
    for path in rng.sample(files, min(len(files), want)):
        chunks = [c.strip() for c in path.read_text(encoding="utf-8", errors="replace").split("\n\n")]
        prose = [c for c in chunks
                 if 80 <= len(c) <= 700 and c[0].isalpha() and "::" not in c and ".." not in c]
        if prose:
            out.append(rng.choice(prose))
    return out


def response_prompts(count: int, heldout: bool, seed: int, stdlib: list[Path],
                     pydoc: list[Path]) -> list[str]:
    """`count` prompts: half specific requests (`detailed_prompt`), half templated tasks, about 40% of them
    code (snippet tasks and docstring stubs), the rest general chat."""
    rng = random.Random(seed + (1 if heldout else 0))
    topics, roles = _split(TOPICS, heldout), _split(ROLES, heldout)
    stubs = implement_stubs(stdlib, rng, count // 5)
    texts = paragraphs(pydoc, rng, count // 10) if pydoc else []
    prompts: dict[str, None] = {}  # insertion-ordered set: a repeated prompt would repeat its greedy answer
    add = prompts.setdefault
    for _ in range(50 * count):
        if len(prompts) >= count:
            break
        kind = rng.randrange(20)  # 10..19: specific multi-constraint requests
        if kind >= 10:
            add(detailed_prompt(rng, topics, roles))
        elif kind <= 1:
            code = code_snippet(stdlib, rng)
            if code:
                add(rng.choice(CODE_TASKS).format(code=code))
        elif kind <= 3 and stubs:
            add(rng.choice(IMPLEMENT_TASKS).format(stub=stubs.pop()))
        elif kind == 4:
            add(rng.choice(WRITING).format(t=rng.choice(topics)))
        elif kind == 5:
            add(rng.choice(ROLEPLAY).format(r=rng.choice(roles), t=rng.choice(topics)))
        elif kind <= 7:
            t, u = rng.sample(topics, 2)
            add(rng.choice(EXPLAIN).format(t=t, u=u))
        elif kind == 8:
            add(arithmetic_prompt(rng))
        elif texts:
            add(rng.choice(EXTRACT).format(p=texts.pop()))
    return list(prompts)
