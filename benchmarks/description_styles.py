"""CLINC150 route descriptions in four writing styles, for description-mode benchmarks.

Description routing must not depend on how its descriptions happen to be written, so
`sweep_decisions.py --modes styles` chooses the description-mode parameters by
cross-validation across these styles (leave one style out, training data only) and
`bench_decisions.py` reports validation figures per style.

Written once from the domain and intent names of domains.json, without looking at any
misroute (train or validation), in four styles a user might write:

- keywords: comma-separated keyword lists;
- one-liner: one short sentence;
- prose: a long paragraph in the third person;
- second person: addressed to the user ("you can ask me ...").

`bench_decisions.DESCRIPTIONS` (revised from training-set misroutes) is a fifth set,
reported beside these as `tuned`.
"""

from __future__ import annotations

KEYWORDS: dict[str, str] = {
    "banking": (
        "bank account, balance, transactions, transfer, pay bill, bill due, minimum "
        "payment, interest rate, routing number, order checks, PIN change, fraud, frozen "
        "account, blocked account, spending history"
    ),
    "credit_cards": (
        "credit card, credit limit, credit score, APR, rewards points, redeem rewards, new "
        "card, card application, expiration date, lost card, stolen card, damaged card, "
        "declined card, replacement card, foreign transaction fees"
    ),
    "kitchen_and_dining": (
        "recipes, cooking, cook time, ingredients, substitutes, calories, nutrition, food "
        "storage, meal ideas, restaurants, restaurant reviews, reservations, table booking, "
        "wait time"
    ),
    "home": (
        "music, songs, playlist, shopping list, to-do list, reminders, calendar, online "
        "orders, order status, smart home, lights, thermostat"
    ),
    "auto_and_commute": (
        "car, driving, directions, traffic, distance, commute, gas, fuel, mpg, oil change, "
        "tires, tire pressure, car maintenance, jump start, uber, ride, current location"
    ),
    "travel": (
        "travel, trips, flights, flight status, hotels, car rental, luggage, carry-on, "
        "visa, vaccines, travel alerts, travel notification, exchange rate, currency, "
        "plug adapter, time zone, translation"
    ),
    "utility": (
        "weather, time, date, alarm, timer, calculator, math, unit conversion, definition, "
        "spelling, phone call, text message, find my phone, share location, coin flip, "
        "dice"
    ),
    "work": (
        "job, work, payday, paycheck, salary, income, direct deposit, taxes, W-2, 401k, "
        "health insurance, benefits, PTO, vacation days, holidays, meetings"
    ),
    "small_talk": (
        "chit-chat, greetings, hello, goodbye, thanks, jokes, fun facts, meaning of life, "
        "assistant's name, age, origin, creator, hobbies, pets, are you a bot"
    ),
    "meta": (
        "assistant settings, yes, no, maybe, cancel, repeat, change name, language, "
        "accent, voice speed, volume, whisper mode, sync device, factory reset"
    ),
}

ONE_LINER: dict[str, str] = {
    "banking": "Questions about your bank account, payments and transfers.",
    "credit_cards": "Everything about credit cards, limits, scores and rewards.",
    "kitchen_and_dining": "Cooking help, recipes, nutrition and restaurant bookings.",
    "home": "Music, lists, reminders, calendar and smart home control.",
    "auto_and_commute": "Driving, directions, traffic and car care.",
    "travel": "Trip planning: flights, hotels, visas and travel tips.",
    "utility": "Quick tools like weather, time, alarms, timers and calculations.",
    "work": "Your job: pay, benefits, taxes, time off and meetings.",
    "small_talk": "Friendly conversation with the assistant about itself and fun stuff.",
    "meta": "Controls for the assistant itself, like voice, language and settings.",
}

PROSE: dict[str, str] = {
    "banking": (
        "This agent is the customer's point of contact for everyday banking. It looks up "
        "account balances and recent transactions, explains how much was spent over a "
        "period, moves money between accounts and pays bills, and tells the customer when "
        "a bill is due and what the minimum payment is. It can also give the routing "
        "number, current interest rates, order new checks, change a PIN, and handle "
        "security problems such as suspected fraud or an account that has been frozen or "
        "blocked."
    ),
    "credit_cards": (
        "This agent manages the customer's credit cards from application to replacement. "
        "It reports the credit limit and can request an increase, shows the credit score "
        "with advice on improving it, explains the annual percentage rate and any fees for "
        "purchases made in other countries, and keeps track of reward points and how to "
        "redeem them. When a card is lost, stolen, damaged, declined or about to expire, "
        "it arranges a replacement and says how long delivery takes; it also follows up "
        "on applications for a new card."
    ),
    "kitchen_and_dining": (
        "This agent helps with food, whether the user is cooking at home or eating out. "
        "It finds recipes and lists their ingredients, suggests substitutions when "
        "something is missing, says how long a dish should cook and how long leftovers "
        "keep, and gives calorie counts and nutrition information. For eating out it "
        "recommends restaurants, summarises their reviews, estimates how busy they are, "
        "checks whether they accept reservations, and books, confirms or cancels a table."
    ),
    "home": (
        "This agent runs the household. It plays music, says which song is on, skips "
        "tracks and edits playlists; keeps shopping lists and to-do lists up to date; sets "
        "and changes reminders; reads and updates the calendar; places online orders and "
        "reports where a delivery is; and controls connected devices around the house "
        "such as lights, locks, heating and appliances."
    ),
    "auto_and_commute": (
        "This agent looks after everything to do with getting around by car or ride "
        "service. It gives directions and distances, reports traffic on the way, finds "
        "the user's current location, and books a ride. For the car itself it tracks "
        "maintenance, says when the last service was and schedules the next one, explains "
        "when and how to change the oil or a tire, checks tire pressure, recommends the "
        "right fuel, reports fuel economy, finds gas stations, and walks through a jump "
        "start."
    ),
    "travel": (
        "This agent plans and supports trips abroad and at home. It books flights, hotels "
        "and rental cars, checks flight status, and explains carry-on rules or what to do "
        "about lost luggage. Before departure it covers visa requirements, recommended "
        "vaccinations, travel advisories, notifying the bank about the trip, the local "
        "time zone, exchange rates and the plug type used at the destination. At the "
        "destination it suggests things to do and translates phrases into the local "
        "language."
    ),
    "utility": (
        "This agent answers small practical requests that need no account. It gives the "
        "weather forecast, the current time and date, sets alarms and timers, does "
        "arithmetic and converts between units, defines and spells words, and rolls dice "
        "or flips a coin. It can also place a phone call, send a text message, locate a "
        "lost phone and share the user's location with someone."
    ),
    "work": (
        "This agent is the employee's human-resources desk. It answers questions about "
        "payday, income and direct deposit, tax documents such as the W-2, and rolling "
        "over a 401k retirement plan. It explains health insurance coverage and handles "
        "changes to benefits, tracks paid time off (how much has been used and how much "
        "remains), submits time-off requests and reports their status, lists upcoming "
        "company holidays, and schedules meetings with colleagues."
    ),
    "small_talk": (
        "This agent handles casual conversation that is not a task. It returns greetings, "
        "goodbyes and thanks, tells jokes and fun facts, muses on the meaning of life, and "
        "answers personal questions about the assistant: its name, its age, where it comes "
        "from, who built it and who it works for, whether it has hobbies or pets, whether "
        "it is a real person, and what kinds of things people can ask it."
    ),
    "meta": (
        "This agent deals with the conversation and the assistant's own configuration "
        "rather than with the outside world. It understands short replies such as yes, "
        "no and maybe, cancels the current request or repeats the last answer, and "
        "changes how the assistant behaves: its name or the name it uses for the user, "
        "the language and accent it speaks, how fast and how loud it talks, whisper mode, "
        "pairing with the user's devices, and restoring factory settings."
    ),
}

SECOND_PERSON: dict[str, str] = {
    "banking": (
        "You can ask me about your bank account: check your balance, see what you spent, "
        "move money, pay a bill or find out when it's due, get your routing number, order "
        "checks, change your PIN, or tell me if you think there's fraud."
    ),
    "credit_cards": (
        "Talk to me about your credit card: I can tell you your limit or raise it, check "
        "your credit score, explain your APR, look up your rewards, help you apply for a "
        "new card, or replace one you lost or that got declined."
    ),
    "kitchen_and_dining": (
        "Ask me what to cook tonight, how to make something, what you can use instead of "
        "an ingredient, or how many calories it has. I can also find you a good "
        "restaurant and book, confirm or cancel your table."
    ),
    "home": (
        "I can play your music, tell you what song this is, add things to your shopping "
        "or to-do list, remind you about something, check your calendar, track your "
        "orders, and turn your lights or other smart devices on and off."
    ),
    "auto_and_commute": (
        "Need to get somewhere? I'll give you directions, tell you how bad traffic is and "
        "how far it is, call you an Uber, and help with your car: gas, oil changes, tire "
        "pressure, maintenance or a dead battery."
    ),
    "travel": (
        "Going on a trip? I can book your flight, hotel or rental car, check if your "
        "flight is on time, tell you if you need a visa or shots, what plug to bring, the "
        "exchange rate, and help you say things in another language."
    ),
    "utility": (
        "Ask me the weather, the time or the date, set an alarm or a timer, do some math "
        "or convert units, define or spell a word, call or text someone, find your phone, "
        "or flip a coin for you."
    ),
    "work": (
        "I can help with your job: when you get paid, your salary, taxes and W-2, your "
        "401k, your health insurance, how much time off you have left or requesting "
        "some, the next holiday, and setting up meetings."
    ),
    "small_talk": (
        "Just want to chat? Say hi, tell me thanks, ask me for a joke or a fun fact, or "
        "ask about me: my name, how old I am, where I'm from, who made me, or whether "
        "I'm a robot."
    ),
    "meta": (
        "You can tell me yes, no or maybe, ask me to cancel or repeat, change what I call "
        "you or what you call me, and change how I talk: language, accent, speed, volume "
        "or whispering. You can also sync your device or reset me."
    ),
}

STYLES: dict[str, dict[str, str]] = {
    "keywords": KEYWORDS,
    "one-liner": ONE_LINER,
    "prose": PROSE,
    "second person": SECOND_PERSON,
}
"""The four styles, by name (each maps every CLINC150 domain to a description)."""
