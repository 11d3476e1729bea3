"""The twelve customer intents of the demo task and the tones a message can take.

Each intent lists the message templates a customer writes, the keywords that identify it in a message (the
gold scorer re-derives the intent from the prompt text with them), the actions that solve it, plausible
actions that do not, and the timelines an agent can promise. Action names refer to ``phrases.ACTIONS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tone = Literal["polite", "neutral", "angry"]
TONES: tuple[Tone, ...] = ("polite", "neutral", "angry")


@dataclass(frozen=True)
class Intent:
    """One reason a customer writes in."""

    name: str
    templates: tuple[str, ...]
    """Message cores; slots ``{product}``, ``{other}`` (a second product), ``{order}``, ``{device}``."""
    keywords: tuple[str, ...]
    """Regexes that identify this intent in a customer message (and no other intent's messages)."""
    correct_actions: tuple[str, ...]
    """Actions that solve the customer's problem."""
    wrong_actions: tuple[str, ...]
    """Plausible-looking actions that do not (any action outside ``correct_actions`` is also wrong)."""
    info: tuple[str, ...]
    """Timelines the agent can give, each matching ``phrases.INFO_PATTERN``."""


INTENTS: tuple[Intent, ...] = (
    Intent("damaged_item",
           ("My {product} arrived broken.", "The {product} from order {order} came damaged.",
            "My {product} was cracked when I opened the box.",
            "Order {order} arrived today and the {product} is broken."),
           (r"\bbroken\b", r"\bdamaged\b", r"\bcracked\b"),
           ("replace", "refund", "return_label"), ("store_credit", "update_app", "trace"),
           ("This should be sorted within 3 to 5 days.", "You will get an email update within 24 hours.")),
    Intent("late_delivery",
           ("My order {order} is late.", "My {product} is late and still not here.",
            "Order {order} was due last week and it is delayed.", "Why is my {product} delayed?"),
           (r"\blate\b", r"\bdelayed\b"),
           ("trace", "expedite"), ("cancel", "store_credit", "return_label"),
           ("It should arrive within 2 to 3 days.", "You will get an email update within 24 hours.")),
    Intent("refund_request",
           ("I want a refund for my {product}.", "Can I get a refund for order {order}?",
            "I would like my money back for the {product}.", "Please refund order {order}."),
           (r"\brefund\b", r"\bmoney back\b"),
           ("refund", "return_label"), ("store_credit", "replace", "apply_discount"),
           ("The money will reach you within 5 to 7 days.",)),
    Intent("wrong_item",
           ("I ordered a {product} but got a {other} instead.", "You sent me the wrong item for order {order}.",
            "Order {order} had a {other} in it instead of my {product}.",
            "This is the wrong item, I never ordered a {other}."),
           (r"\bwrong item\b", r"\binstead\b"),
           ("reship", "return_label"), ("store_credit", "trace", "apply_discount"),
           ("The right item should arrive within 3 to 5 days.",)),
    Intent("password_reset",
           ("I forgot my password.", "I can't log in because I forgot my password.",
            "My password does not work anymore.", "How do I reset my password on the {device}?"),
           (r"\bpassword\b", r"\blog in\b"),
           ("reset_link",), ("update_app", "store_credit", "cancel"),
           ("The email should reach you within 10 minutes.",)),
    Intent("double_charge",
           ("I was charged twice for order {order}.", "My card was charged twice for the {product}.",
            "I see two charges for the same order.", "You billed me two times for order {order}."),
           (r"\bcharged twice\b", r"\btwo charges\b", r"\btwo times\b"),
           ("reverse_charge",), ("refund", "store_credit", "cancel"),
           ("It will drop off your card within 3 to 5 days.",)),
    Intent("cancellation",
           ("Please cancel my order {order}.", "I want to cancel the {product} I just ordered.",
            "Can you cancel order {order} before it ships?", "I changed my mind, please cancel my order."),
           (r"\bcancel\b",),
           ("cancel",), ("expedite", "update_address", "store_credit"),
           ("You will get a confirmation email within 24 hours.",)),
    Intent("address_change",
           ("I need to change the address on order {order}.", "I moved, please send my {product} to my new address.",
            "The shipping address on order {order} is old.", "Can I update the address for my {product}?"),
           (r"\baddress\b",),
           ("update_address",), ("cancel", "trace", "expedite"),
           ("The change will show within 2 hours.",)),
    Intent("missing_package",
           ("My package says delivered but it is not here.", "Order {order} is missing, the tracking says delivered.",
            "My {product} never showed up and the box is lost.", "The package for order {order} is lost."),
           (r"\bmissing\b", r"\blost\b", r"\bsays delivered\b"),
           ("trace", "reship"), ("update_address", "store_credit", "return_label"),
           ("You will hear from us within 48 hours.",)),
    Intent("warranty",
           ("My {product} stopped working after two months, is it under warranty?",
            "Is my {product} still under warranty?", "The {product} stopped working, I want to use the warranty.",
            "My {product} from order {order} stopped working."),
           (r"\bwarranty\b", r"\bstopped working\b"),
           ("warranty_claim", "replace"), ("return_label", "update_app", "store_credit"),
           ("Our repair team will reply within 2 days.",)),
    Intent("app_crash",
           ("Your app keeps crashing on my {device}.", "The app crashes every time I open it.",
            "The app closes by itself on my {device}.", "I can't check my order because the app keeps crashing."),
           (r"\bapp\b", r"\bcrash"),
           ("bug_report", "update_app"), ("reset_link", "store_credit", "refund"),
           ("A fix should be out within 7 days.",)),
    Intent("discount",
           ("My discount code did not work on order {order}.", "The promo code was not applied to my {product}.",
            "I forgot to use my discount code.", "Can I still get the sale price for the {product}?"),
           (r"\bdiscount\b", r"\bpromo code\b", r"\bsale price\b"),
           ("apply_discount", "store_credit"), ("refund", "cancel", "reverse_charge"),
           ("You will see the new price within 24 hours.",)),
)

INTENTS_BY_NAME: dict[str, Intent] = {intent.name: intent for intent in INTENTS}

#: Sentences around the message core, by tone ("" = none).
OPENERS: dict[Tone, tuple[str, ...]] = {
    "polite": ("Hello.", "Hi there.", "Good morning."),
    "neutral": ("",),
    "angry": ("This is ridiculous!", "I am very upset.", "Unbelievable."),
}
CLOSERS: dict[Tone, tuple[str, ...]] = {
    "polite": ("Could you please help?", "Thank you!", "Thanks in advance."),
    "neutral": ("", "Please advise."),
    "angry": ("Fix this now!", "I want an answer today!", "This is the worst service ever."),
}
#: Detects an angry customer in a message (the gold scorer expects empathy for them).
ANGRY_PATTERN = r"\bridiculous\b|\bvery upset\b|\bunbelievable\b|\bfix this now\b|\banswer today\b|\bworst service\b"
