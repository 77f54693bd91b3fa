"""Fixed texts for measurements (perplexity, agreement with llama.cpp) and
the prompts the tests generate from. Written for this project."""

#: Plain English prose, ~330 tokens with the SmolLM2 vocabulary.
PPL_TEXT = (
    "The old harbour town wakes up slowly in winter. Before sunrise the fishing boats leave one by one, their "
    "engines coughing in the cold air, and the gulls follow them out past the breakwater. By eight o'clock the "
    "bakery on the corner has opened its shutters, and the smell of fresh bread drifts down towards the water. "
    "Most of the shops along the main street stay closed until the afternoon, because there are few visitors at "
    "this time of year and the owners prefer to repair their nets, paint their doors and visit their families.\n\n"
    "The town library is the warmest building in the street. It was built more than a hundred years ago with "
    "money left by a sea captain who had never learned to read as a child. On the wall beside the entrance there "
    "is a portrait of him, a stern man with a grey beard, holding a book as if he were still surprised to own "
    "one. Children come after school to do their homework at the long wooden tables, and retired sailors sit by "
    "the window with the newspapers, arguing about the weather and the price of fuel.\n\n"
    "In the evening the wind usually rises, and the waves break hard against the harbour wall. People hurry home "
    "with their collars turned up, and the lights come on in the small houses on the hill. From the top of the "
    "hill you can see the lighthouse turning slowly, sending its beam across the dark water every ten seconds, "
    "just as it has done every night for as long as anyone in the town can remember."
)

#: A paragraph for teacher-forced next-token agreement with llama.cpp.
AGREEMENT_TEXT = (
    "Water boils at one hundred degrees Celsius at sea level, but at the top of a high mountain it boils at a "
    "lower temperature because the air pressure is lower. This is why cooking pasta or rice takes longer in the "
    "mountains: the water never gets as hot as it would at the coast. Pressure cookers work in the opposite "
    "way. By sealing the pot, they let the pressure inside rise above the pressure of the atmosphere, so the "
    "water can reach a higher temperature before it boils, and food cooks faster. Engineers use the same idea "
    "in power stations, where water is heated under high pressure to drive turbines that produce electricity."
)

#: Prompts the equality tests generate from (raw continuation and chat).
PROMPTS = (
    "The history of the printing press begins in",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "CHAT:Explain in a few sentences why the sky is blue.",
)
